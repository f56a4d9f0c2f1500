//! Kernel autotune: on the first use of a shape class, every candidate variant of a hot kernel is
//! timed on the op's own operands and the fastest is kept, in memory and in a small file keyed by
//! adapter and driver, so later processes skip the trial. The kernels tuned: the f32 matmul (the
//! tile shapes of `MatmulConfig::TILES` that fit the adapter, and the subgroup kernel where the
//! adapter has a fixed subgroup size), the half matmul (the same tiles with half loads), and the
//! one-workgroup-per-row kernels (reductions, softmax and its backward, layer norm and its
//! backward, cross-entropy): their workgroup size, among `ROW_WG_CHOICES`, and the one-subgroup
//! variant where the adapter has a fixed subgroup size.
//!
//! `WGPIPE_AUTOTUNE`: `on` / `off` (default: on for hardware adapters; off for software ones,
//! whose heuristic is tuned already and where a trial costs CPU time in every test process),
//! `reset` (on, after forgetting this adapter's saved choices). `WGPIPE_AUTOTUNE_CACHE` names the
//! file (default `$XDG_CACHE_HOME/wgpipe/autotune.tsv`, else `~/.cache/wgpipe/autotune.tsv`).
//! `Device::reset_autotune` forgets them at run time.

use std::collections::HashMap;
use std::fmt::Debug;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use wgpipe_shaders::RowGroup;

use crate::backend::MatDims;
use crate::error::Result;

/// Turns the tuner on or off, or resets it (see the module doc).
pub const AUTOTUNE_ENV: &str = "WGPIPE_AUTOTUNE";
/// The file of saved choices.
pub const AUTOTUNE_CACHE_ENV: &str = "WGPIPE_AUTOTUNE_CACHE";

/// A variant the tuner can pick, written to the file as its label.
pub(crate) trait Choice: Copy + PartialEq + Debug {
    fn label(&self) -> String;
    fn parse(s: &str) -> Option<Self>;
}

/// One matmul variant the tuner can pick.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum MatmulChoice {
    /// The tiled kernel with tile `(bm, bn, bk, tm, tn)`.
    Tile(u32, u32, u32, u32, u32),
    /// Packed operands and the subgroup kernel.
    Subgroup,
}

impl Choice for MatmulChoice {
    fn label(&self) -> String {
        match self {
            MatmulChoice::Tile(bm, bn, bk, tm, tn) => format!("tile {bm}x{bn}x{bk} {tm}x{tn}"),
            MatmulChoice::Subgroup => "subgroup".into(),
        }
    }

    fn parse(s: &str) -> Option<MatmulChoice> {
        if s == "subgroup" {
            return Some(MatmulChoice::Subgroup);
        }
        let rest = s.strip_prefix("tile ")?;
        let nums: Vec<u32> = rest
            .split(['x', ' '])
            .map(|v| v.parse().ok())
            .collect::<Option<_>>()?;
        match nums[..] {
            [bm, bn, bk, tm, tn] => Some(MatmulChoice::Tile(bm, bn, bk, tm, tn)),
            _ => None,
        }
    }
}

/// How a one-workgroup-per-row kernel combines its row: `row wg N` (a workgroup-memory tree over
/// N invocations) or `row subgroup N` (one subgroup of N).
impl Choice for RowGroup {
    fn label(&self) -> String {
        let kind = if self.subgroup { "subgroup" } else { "wg" };
        format!("row {kind} {}", self.wg)
    }

    fn parse(s: &str) -> Option<RowGroup> {
        let rest = s.strip_prefix("row ")?;
        if let Some(wg) = rest.strip_prefix("wg ") {
            return wg.parse().ok().map(RowGroup::tree);
        }
        rest.strip_prefix("subgroup ")?
            .parse()
            .ok()
            .map(RowGroup::subgroup)
    }
}

/// The shape class a matmul choice is kept for: each of m, n, k rounded up to a power of two,
/// and whether the product is batched; `half` names the operands' dtype when they are not f32.
pub(crate) fn shape_class(d: &MatDims, half: Option<&str>) -> String {
    let p = |v: usize| v.max(1).next_power_of_two();
    format!(
        "{}{} m{} n{} k{}",
        half.map(|h| format!("{h} ")).unwrap_or_default(),
        if d.batch > 1 { "batched" } else { "single" },
        p(d.m),
        p(d.n),
        p(d.k)
    )
}

/// The shape class a row kernel's choice is kept for: the op, and its rows and columns each
/// rounded up to a power of two (short rows want few invocations each, long ones many; few rows
/// leave the adapter idle unless each has many).
pub(crate) fn row_class(op: &str, rows: usize, cols: usize) -> String {
    let p = |v: usize| v.max(1).next_power_of_two();
    format!("{op} rows{} cols{}", p(rows), p(cols))
}

/// Whether the tuner runs for an adapter (`software`: a CPU-backed one), and whether its saved
/// choices are to be forgotten first, from the value of `WGPIPE_AUTOTUNE`.
pub(crate) fn mode_from(value: Option<&str>, software: bool) -> (bool, bool) {
    match value.map(|v| v.trim().to_ascii_lowercase()).as_deref() {
        Some("0" | "off" | "false" | "no") => (false, false),
        Some("1" | "on" | "true" | "yes") => (true, false),
        Some("reset") => (true, true),
        _ => (!software, false),
    }
}

/// The default file of saved choices.
pub(crate) fn default_cache_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(AUTOTUNE_CACHE_ENV).filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("wgpipe").join("autotune.tsv"))
}

/// One line of the file: adapter key, shape class, choice label, tab-separated.
fn parse_line(line: &str) -> Option<(&str, &str, &str)> {
    let mut f = line.split('\t');
    Some((f.next()?, f.next()?, f.next()?))
}

/// The choices of one adapter: measured on first use of a shape class, then looked up.
pub(crate) struct Tuner {
    /// Adapter name, backend and driver: what a choice is valid for.
    key: String,
    path: Option<PathBuf>,
    /// Shape class -> the label of its choice (parsed by the kernel family that asks).
    chosen: Mutex<HashMap<String, String>>,
}

impl Tuner {
    /// The tuner of adapter `key`, with the choices saved in `path` (forgotten first when
    /// `reset`). A file that cannot be read or written only costs the saving.
    pub(crate) fn new(key: &str, path: Option<PathBuf>, reset: bool) -> Tuner {
        let key: String = key
            .chars()
            .map(|c| if c == '\t' || c == '\n' { ' ' } else { c })
            .collect();
        let t = Tuner {
            key,
            path,
            chosen: Mutex::new(HashMap::new()),
        };
        if reset {
            t.reset();
        } else if let Some(text) = t
            .path
            .as_deref()
            .and_then(|p| std::fs::read_to_string(p).ok())
        {
            let mut chosen = t.lock();
            for (key, class, choice) in text.lines().filter_map(parse_line) {
                if key == t.key {
                    chosen.insert(class.to_string(), choice.to_string());
                }
            }
        }
        t
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, String>> {
        self.chosen.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The saved choice for `class` if it is among `candidates`; else each candidate is timed by
    /// `measure` (seconds) and the fastest is kept and saved.
    pub(crate) fn choose<C: Choice>(
        &self,
        class: &str,
        candidates: &[C],
        mut measure: impl FnMut(C) -> Result<f64>,
    ) -> Result<C> {
        if let Some(c) = self.chosen(class).filter(|c| candidates.contains(c)) {
            return Ok(c);
        }
        let mut best: Option<(C, f64)> = None;
        for &c in candidates {
            let t = measure(c)?;
            if best.is_none_or(|(_, bt)| t < bt) {
                best = Some((c, t));
            }
        }
        let Some((choice, _)) = best else {
            return Err(crate::error::Error::invalid(
                "autotune",
                format!("no candidate for {class}"),
            ));
        };
        self.lock().insert(class.to_string(), choice.label());
        if let Some(p) = &self.path {
            // Best effort: a read-only cache directory only means tuning again next time.
            let _ = append_line(p, &format!("{}\t{class}\t{}\n", self.key, choice.label()));
        }
        Ok(choice)
    }

    /// The choice kept for `class`, if any (and if it reads as a `C`).
    pub(crate) fn chosen<C: Choice>(&self, class: &str) -> Option<C> {
        self.lock().get(class).and_then(|l| C::parse(l))
    }

    /// Forgets this adapter's choices, in memory and in the file (other adapters' lines stay).
    pub(crate) fn reset(&self) {
        self.lock().clear();
        let Some(p) = &self.path else { return };
        let Ok(text) = std::fs::read_to_string(p) else {
            return;
        };
        let kept: String = text
            .lines()
            .filter(|l| parse_line(l).is_some_and(|(key, ..)| key != self.key))
            .map(|l| format!("{l}\n"))
            .collect();
        let _ = std::fs::write(p, kept);
    }
}

fn append_line(path: &Path, line: &str) -> std::io::Result<()> {
    use std::io::Write;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?
        .write_all(line.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: MatmulChoice = MatmulChoice::Tile(64, 64, 16, 4, 4);
    const B: MatmulChoice = MatmulChoice::Tile(128, 128, 8, 8, 8);
    const S: MatmulChoice = MatmulChoice::Subgroup;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("wgpipe-autotune-{}-{name}", std::process::id()));
        let _ = std::fs::remove_file(&d);
        d
    }

    /// A measure that answers from `times` and counts its calls.
    fn fake<'a>(
        times: &'a [(MatmulChoice, f64)],
        calls: &'a std::cell::Cell<usize>,
    ) -> impl FnMut(MatmulChoice) -> Result<f64> + 'a {
        move |c| {
            calls.set(calls.get() + 1);
            Ok(times.iter().find(|(k, _)| *k == c).unwrap().1)
        }
    }

    #[test]
    fn picks_the_fastest_measured_candidate_whatever_its_position() {
        for fastest in 0..3 {
            let cands = [A, B, S];
            let times: Vec<(MatmulChoice, f64)> = cands
                .iter()
                .enumerate()
                .map(|(i, &c)| (c, if i == fastest { 1.0 } else { 2.0 + i as f64 }))
                .collect();
            let t = Tuner::new("gpu", None, false);
            let calls = std::cell::Cell::new(0);
            let got = t.choose("single m256 n256 k256", &cands, fake(&times, &calls));
            assert_eq!(got.unwrap(), cands[fastest]);
            assert_eq!(calls.get(), 3, "every candidate is timed once");
        }
    }

    #[test]
    fn a_choice_is_kept_per_class_saved_per_adapter_and_reset() {
        let path = tmp("kept");
        let times = [(A, 3.0), (B, 1.0), (S, 2.0)];
        let calls = std::cell::Cell::new(0);
        let t = Tuner::new("gpu one|Vulkan|driver 1", Some(path.clone()), false);
        assert_eq!(t.choose("c1", &[A, B, S], fake(&times, &calls)).unwrap(), B);
        // Looked up, not measured again.
        assert_eq!(t.choose("c1", &[A, B, S], fake(&times, &calls)).unwrap(), B);
        assert_eq!(calls.get(), 3);
        // A saved choice that is not a candidate now (another limit) is measured again.
        assert_eq!(t.choose("c1", &[A, S], fake(&times, &calls)).unwrap(), S);
        // A row kernel's choice lives in the same file, under its own class.
        let row = "softmax rows64 cols128";
        let (tree, sg) = (RowGroup::tree(256), RowGroup::subgroup(32));
        let got = t.choose(row, &[tree, sg], |c| Ok(if c.subgroup { 1.0 } else { 2.0 }));
        assert_eq!(got.unwrap(), sg);
        // Another process on the same adapter reads them back; another adapter does not.
        let again = Tuner::new("gpu one|Vulkan|driver 1", Some(path.clone()), false);
        assert_eq!(again.chosen::<MatmulChoice>("c1"), Some(S));
        assert_eq!(again.chosen::<RowGroup>(row), Some(sg));
        // A label of another family does not read as this one's choice.
        assert_eq!(again.chosen::<MatmulChoice>(row), None);
        let other = Tuner::new("gpu one|Vulkan|driver 2", Some(path.clone()), false);
        assert_eq!(other.chosen::<MatmulChoice>("c1"), None);
        assert_eq!(other.choose("c1", &[A], fake(&times, &calls)).unwrap(), A);
        // Reset forgets this adapter's choices only.
        again.reset();
        assert_eq!(again.chosen::<MatmulChoice>("c1"), None);
        let fresh = Tuner::new("gpu one|Vulkan|driver 1", Some(path.clone()), false);
        assert_eq!(fresh.chosen::<MatmulChoice>("c1"), None);
        let other2 = Tuner::new("gpu one|Vulkan|driver 2", Some(path.clone()), false);
        assert_eq!(other2.chosen::<MatmulChoice>("c1"), Some(A));
        // `reset` at construction (WGPIPE_AUTOTUNE=reset) does the same.
        let reset = Tuner::new("gpu one|Vulkan|driver 2", Some(path.clone()), true);
        assert_eq!(reset.chosen::<MatmulChoice>("c1"), None);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_failing_trial_is_an_error_and_nothing_is_kept() {
        let t = Tuner::new("gpu", None, false);
        let e = t.choose("c", &[A, B], |c| {
            if c == B {
                Err(crate::error::Error::invalid("matmul", "trial failed"))
            } else {
                Ok(1.0)
            }
        });
        assert!(e.is_err());
        assert_eq!(t.chosen::<MatmulChoice>("c"), None);
    }

    #[test]
    fn labels_round_trip_and_env_values_map_to_modes() {
        for c in [A, B, S] {
            assert_eq!(MatmulChoice::parse(&c.label()), Some(c));
        }
        assert_eq!(MatmulChoice::parse("tile 1x2"), None);
        for g in [RowGroup::tree(64), RowGroup::subgroup(32)] {
            assert_eq!(RowGroup::parse(&g.label()), Some(g));
            assert_eq!(MatmulChoice::parse(&g.label()), None);
        }
        assert_ne!(RowGroup::tree(32).label(), RowGroup::subgroup(32).label());
        assert_eq!(RowGroup::parse(&A.label()), None);
        assert_eq!(mode_from(None, false), (true, false));
        assert_eq!(mode_from(None, true), (false, false));
        assert_eq!(mode_from(Some("on"), true), (true, false));
        assert_eq!(mode_from(Some("OFF"), false), (false, false));
        assert_eq!(mode_from(Some("reset"), true), (true, true));
        let d = |batch, m, n, k| MatDims { batch, m, k, n };
        assert_eq!(
            shape_class(&d(1, 200, 256, 1000), None),
            "single m256 n256 k1024"
        );
        assert_eq!(shape_class(&d(8, 64, 64, 16), None), "batched m64 n64 k16");
        assert_eq!(
            shape_class(&d(8, 64, 64, 16), Some("bf16")),
            "bf16 batched m64 n64 k16"
        );
        assert_eq!(row_class("softmax", 1000, 128), "softmax rows1024 cols128");
    }
}
