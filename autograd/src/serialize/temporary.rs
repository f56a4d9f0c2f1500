//! The temporary files that make a save atomic: one of a unique name per save beside the target,
//! the removal of those left by processes that died, and the folder sync after the rename.

use std::fs;
use std::path::{Path, PathBuf};

/// Suffix of the temporary files of a save.
const TMP_SUFFIX: &str = ".wgpipe-tmp";

/// `.<file name>.` — what the temporaries of saves to `path` start with.
fn tmp_prefix(path: &Path) -> Option<String> {
    Some(format!(".{}.", path.file_name()?.to_str()?))
}

/// Creates (exclusively: never an existing file) an empty temporary file of a name no other
/// save uses, `.<name>.<pid>-<n>.wgpipe-tmp`, beside `path`.
pub(super) fn create_temporary(path: &Path) -> std::result::Result<PathBuf, String> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let prefix = tmp_prefix(path).ok_or("not a file path (it has no UTF-8 file name)")?;
    let pid = std::process::id();
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let tmp = path.with_file_name(format!("{prefix}{pid}-{n}{TMP_SUFFIX}"));
        match fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
        {
            Ok(_) => return Ok(tmp),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(format!("cannot write {}: {e}", tmp.display())),
        }
    }
}

/// Removes the temporaries of saves to `path` whose process is gone (best effort). Those of
/// this process are another thread's save in flight and are kept; so are those of a live
/// process. Where liveness cannot be checked (no `/proc`), a temporary older than a day counts
/// as stale.
pub(super) fn clean_stale_temporaries(path: &Path) {
    let Some(prefix) = tmp_prefix(path) else {
        return;
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let me = std::process::id();
    let proc_fs = Path::new("/proc/self").exists();
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(rest) = name
            .strip_prefix(prefix.as_str())
            .and_then(|r| r.strip_suffix(TMP_SUFFIX))
        else {
            continue;
        };
        let Some(pid) = rest
            .split_once('-')
            .and_then(|(pid, n)| n.parse::<u64>().ok().and(pid.parse::<u32>().ok()))
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        let stale = if proc_fs {
            !Path::new("/proc").join(pid.to_string()).exists()
        } else {
            e.metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age.as_secs() > 24 * 3600)
        };
        if stale {
            let _ = fs::remove_file(e.path());
        }
    }
}

/// Makes the rename durable (best effort: not every platform can sync a folder).
pub(super) fn sync_dir(path: &Path) {
    #[cfg(unix)]
    {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        if let Ok(d) = fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
    #[cfg(not(unix))]
    let _ = path;
}

/// Writes `bytes` to `path` atomically (a unique temporary file beside it, fsync, rename, folder
/// sync), like a safetensors save: for the small files that go with checkpoints (a sharded
/// checkpoint's index), so that a reader sees the old file or the new one, never half of one.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> wgpipe_tensor::Result<()> {
    use std::io::Write;
    let op = "write_atomically";
    clean_stale_temporaries(path);
    let tmp = create_temporary(path).map_err(|e| super::err(op, path, e))?;
    let written = fs::OpenOptions::new()
        .write(true)
        .open(&tmp)
        .and_then(|mut f| {
            f.write_all(bytes)?;
            f.sync_all()
        });
    if let Err(e) = written.and_then(|()| fs::rename(&tmp, path)) {
        let _ = fs::remove_file(&tmp);
        return Err(super::err(
            op,
            path,
            format!("cannot write it through {}: {e}", tmp.display()),
        ));
    }
    sync_dir(path);
    Ok(())
}
