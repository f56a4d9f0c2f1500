//! The crates' layers, held: every `crate::` path in the non-test code of a top-level module
//! of `pipeline` or `tensor` must lead to the module itself or to one its crate's table allows,
//! so each crate's modules import one way (the pipeline's `schedule/` stays pure data, `plan/`
//! rests on `schedule/` and `sim/` only, and nothing below `train/` reaches up into it; the
//! tensor crate's kernels see storage and layouts, never a `Device` or a `Tensor`). A name a
//! crate root re-exports (`crate::Result`) counts as the module it comes from. Test-only files
//! (`tests.rs`) may reach anywhere.

use std::collections::BTreeMap;
use std::path::Path;

/// What each top-level module of the pipeline crate may import (besides itself). The root's
/// leaf modules (`error`, `partition`, `microbatch`, `skips`, `fast_hash`) and the `LossFn`
/// type (`lib`) are shared foundations.
const PIPELINE: &[(&str, &[&str])] = &[
    ("fast_hash", &[]),
    ("schedule", &["fast_hash"]),
    ("sim", &["schedule", "fast_hash"]),
    ("partition", &[]),
    ("error", &["partition", "schedule", "sim"]),
    ("microbatch", &["error"]),
    ("skips", &["error", "schedule"]),
    (
        "exec",
        &[
            "schedule",
            "sim",
            "error",
            "partition",
            "microbatch",
            "skips",
            "lib",
        ],
    ),
    (
        "plan",
        &[
            "schedule",
            "sim",
            "error",
            "partition",
            "microbatch",
            "skips",
            "lib",
        ],
    ),
    (
        "train",
        &[
            "schedule",
            "sim",
            "exec",
            "plan",
            "error",
            "partition",
            "microbatch",
            "skips",
            "lib",
        ],
    ),
    ("lib", &[]),
];

/// The tensor crate's, bottom up: leaf modules (`dtype`, `error`, `layout`, `rng`, the pools,
/// the per-thread counters), then storage and the kernels' view of it (`raw`), the kernels'
/// contract (`backend`) and the two backends, the `device` that picks one, the dtype policy
/// that meets them, and last the `Tensor` and its op front-ends (`ops`).
const TENSOR: &[(&str, &[&str])] = &[
    ("dtype", &[]),
    ("error", &["dtype"]),
    ("layout", &["error"]),
    ("rng", &[]),
    ("work", &[]),
    ("host_pool", &[]),
    ("gpu_pool", &[]),
    ("memory", &["dtype", "error", "work"]),
    (
        "storage",
        &["dtype", "error", "memory", "host_pool", "gpu_pool"],
    ),
    ("raw", &["dtype", "error", "layout", "memory", "storage"]),
    ("backend", &["dtype", "error", "memory", "raw"]),
    (
        "cpu",
        &[
            "backend",
            "dtype",
            "error",
            "layout",
            "memory",
            "raw",
            "rng",
            "storage",
            "host_pool",
            "work",
        ],
    ),
    (
        "wgpu",
        &[
            "backend", "dtype", "error", "layout", "memory", "raw", "rng", "storage", "gpu_pool",
        ],
    ),
    (
        "device",
        &["backend", "cpu", "wgpu", "error", "memory", "work"],
    ),
    (
        "tensor",
        &[
            "device", "dtype", "error", "layout", "memory", "raw", "rng", "storage",
        ],
    ),
    (
        "dtype_policy",
        &["backend", "device", "dtype", "error", "raw", "tensor"],
    ),
    (
        "ops",
        &[
            "backend",
            "device",
            "dtype",
            "dtype_policy",
            "error",
            "layout",
            "memory",
            "raw",
            "rng",
            "storage",
            "tensor",
        ],
    ),
    ("lib", &[]),
];

/// The module each name re-exported at the crate root comes from (`pub use a::b::{C, D}`).
fn root_reexports(lib: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stmt = String::new();
    for line in lib.lines() {
        let line = line.trim();
        if stmt.is_empty() && !line.starts_with("pub use ") {
            continue;
        }
        stmt.push_str(line);
        if !line.ends_with(';') {
            continue;
        }
        let body = stmt.trim_start_matches("pub use ").trim_end_matches(';');
        let module = body.split("::").next().unwrap_or("").to_string();
        let names = body.rsplit("::").next().unwrap_or("");
        for name in names.trim_matches(|c| c == '{' || c == '}').split(',') {
            let name = name.trim();
            if !name.is_empty() {
                out.insert(name.to_string(), module.clone());
            }
        }
        stmt.clear();
    }
    out
}

/// The top-level module a source file belongs to (`exec/transport/mpi.rs` -> `exec`).
fn top_of(rel: &Path) -> String {
    let first = rel
        .components()
        .next()
        .unwrap()
        .as_os_str()
        .to_string_lossy();
    first.trim_end_matches(".rs").to_string()
}

/// The top-level modules named by `crate::` paths in the code before the file's tests.
fn imports(src: &str, reexports: &BTreeMap<String, String>) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in src.lines().enumerate() {
        if line.trim_start().starts_with("#[cfg(test)]") {
            break;
        }
        let code = line.split("//").next().unwrap_or("");
        for (i, _) in code.match_indices("crate::") {
            let rest = &code[i + "crate::".len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if name.is_empty() {
                continue; // `crate::{a, b}`: the names follow on their own
            }
            let module = match reexports.get(&name) {
                Some(m) => m.clone(),
                // A type defined in lib.rs itself (`LossFn`).
                None if name.starts_with(char::is_uppercase) => "lib".to_string(),
                None => name,
            };
            out.push((n + 1, module));
        }
    }
    out
}

fn files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Every import of crate `name` (its folder beside this crate's) that its `table` does not
/// allow, and how many `crate::` paths were seen.
fn upward_imports(name: &str, table: &[(&str, &[&str])]) -> (Vec<String>, usize) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(name)
        .join("src");
    let reexports = root_reexports(&std::fs::read_to_string(src.join("lib.rs")).unwrap());
    let allowed: BTreeMap<&str, &[&str]> = table.iter().copied().collect();
    let mut all = Vec::new();
    files(&src, &mut all);
    let mut wrong = Vec::new();
    let mut seen = 0;
    for path in &all {
        let rel = path.strip_prefix(&src).unwrap();
        if rel.file_name().is_some_and(|f| f == "tests.rs") {
            continue;
        }
        let from = top_of(rel);
        let ok = allowed.get(from.as_str()).unwrap_or_else(|| {
            panic!(
                "{name}/src/{}: a top-level module not in the table",
                rel.display()
            )
        });
        for (line, to) in imports(&std::fs::read_to_string(path).unwrap(), &reexports) {
            seen += 1;
            if to != from && !ok.contains(&to.as_str()) {
                wrong.push(format!(
                    "{name}/src/{}:{line}: {from} imports {to}",
                    rel.display()
                ));
            }
        }
    }
    (wrong, seen)
}

#[test]
fn modules_import_only_from_the_layers_below_them() {
    for (name, table) in [("pipeline", PIPELINE), ("tensor", TENSOR)] {
        let (wrong, seen) = upward_imports(name, table);
        assert!(
            seen > 100,
            "{name}: only {seen} crate:: paths found: is the scan broken?"
        );
        assert!(
            wrong.is_empty(),
            "{name} imports upward:\n{}",
            wrong.join("\n")
        );
    }
}

#[test]
fn the_scan_sees_an_upward_import() {
    let reexports = root_reexports("pub use train::{Pipeline, X};\npub use error::Result;");
    let found = imports(
        "use crate::Pipeline;\nfn f() -> crate::Result<()> { crate::sim::x() }\n#[cfg(test)]\nuse crate::train;",
        &reexports,
    );
    assert_eq!(
        found,
        vec![
            (1, "train".to_string()),
            (2, "error".to_string()),
            (2, "sim".to_string())
        ]
    );
}
